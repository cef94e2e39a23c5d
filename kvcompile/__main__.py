"""`python -m kvcompile` is the `kvcompile` command."""
from kvcompile.tools.cli import main

main()
