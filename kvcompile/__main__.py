"""`python -m kvcompile` is the `kvcompile` command."""
from kvcompile.cli import main

main()
