"""Applied to an unchanged model from outside: activation checkpointing -> compile -> sharding."""
