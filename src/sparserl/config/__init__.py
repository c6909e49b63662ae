"""The experiment's settings: typed sections with their help text, YAML loading and CLI overrides (`schema`), the
checks across fields (`validation`), and one command-line flag per field (`flags`)."""
