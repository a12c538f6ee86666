"""The FedTOPS ServerApp: validates the run config, runs the strategy, writes the run folder."""
