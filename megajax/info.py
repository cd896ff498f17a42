"""``python -m megajax.info``: runs ``megajax.tools.info``, where its code and documentation are."""

from megajax.cli import exit_on_user_error
from megajax.tools.info import main

if __name__ == "__main__":
    exit_on_user_error(main)
