"""The run configuration's types and the project's errors, below every other layer: this package
imports nothing of the project, and every package of ``fedopd`` may import it."""
