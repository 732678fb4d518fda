"""kohya options in: the argument table, config.toml / dataset.toml reading, the settings type."""
