"""``python -m wsitrain``: the same CLI as the ``wsitrain`` command."""

from wsitrain.cli import main

main()
