"""The seeded-mutant catalog (mutants/catalog/*.toml) and its runner (`python -m mutants`)."""
