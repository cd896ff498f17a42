"""``python -m megajax.scaling``: runs ``megajax.tools.scaling``, where its code and documentation are."""

from megajax.cli import exit_on_user_error
from megajax.tools.scaling import main

if __name__ == "__main__":
    exit_on_user_error(main)
