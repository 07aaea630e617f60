"""What `make setup` runs to install the project, kept out of the installed package: each
module runs as a file (`python tools/NAME.py`) with the standard library alone, some before
the package exists. The tests import them from here."""
