"""Built-in scenarios (package data): the seed's deployments as TOML, loadable by name."""
