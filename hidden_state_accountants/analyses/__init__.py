"""One module per paper, and ``shifted_interpolation`` for what docs/derivations.md derives
from Bok, Su & Altschuler's argument. Each analysis maps a :class:`TrainingRunDpEvent` to a
bound or to the reason its theorem does not apply."""
