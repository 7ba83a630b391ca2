"""One module per paper. Each analysis maps a :class:`TrainingRunDpEvent` to a bound or to
the reason its theorem does not apply."""
