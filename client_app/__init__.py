"""The FedTOPS ClientApp: a thin Flower shell around :mod:`fedopd.engine.round`."""
