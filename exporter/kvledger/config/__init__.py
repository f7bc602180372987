"""The configuration: the typed configuration (``types``) and the YAML loader (``loader``), apart so that
what only reads a configuration never imports the loader and the engine kinds it checks against."""
