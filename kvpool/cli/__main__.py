"""``python -m kvpool.cli``: the ``kvpool`` command (for machines where the script is not on PATH)."""

from kvpool.cli import script

if __name__ == "__main__":
    script()
