"""Train-step cases and benchmarks that exercise jlms on realistic models."""
