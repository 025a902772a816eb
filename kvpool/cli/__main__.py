"""``python -m kvpool.cli``: the ``kvpool`` command (for machines where the script is not on PATH)."""

from kvpool.cli import main

if __name__ == "__main__":
    main()
