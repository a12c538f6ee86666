"""A client's round end to end, from the settings' groups to numbers: rollouts, the teacher, local
OPD, the scoring cache, and held-out evaluation (what ``client_app`` calls). It imports every
package of :mod:`fedopd` below :mod:`fedopd.config`, and not the config itself."""
