"""The experiment's settings: typed sections with their help text, YAML loading, CLI overrides and
validation (`schema`), and one command-line flag per field (`flags`)."""
