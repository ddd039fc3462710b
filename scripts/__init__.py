"""Command-line tools (benchmark, ...); a package so their modules import one another."""
