"""What a benchmark prints, also kept for its ``--output`` file."""

import sys


class Tee:
    """Writes what the benchmark prints to stdout and to ``--output`` as well."""

    def __init__(self, path):
        self.path, self.parts = path, []

    def write(self, text):
        self.parts.append(text)
        return sys.__stdout__.write(text)

    def flush(self):
        sys.__stdout__.flush()

    def save(self):
        with open(self.path, "w") as f:
            f.write("".join(self.parts))
