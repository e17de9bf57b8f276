"""`python -m cunorm` is the `cunorm` command."""
from .cli import main

main(prog_name="cunorm")
