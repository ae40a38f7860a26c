"""memfit's command line: one module per subcommand, each with `run(argv) -> exit code`."""
