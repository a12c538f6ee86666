"""``python -m fedopd.config [FILE.toml] [--run-config ...]``: validate a preset (:func:`fedopd.config.presets.main`)."""

from fedopd.config.presets import main

raise SystemExit(main())
