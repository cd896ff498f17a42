"""``python -m megajax.comm_report``: runs ``megajax.tools.comm_report``, where its code and documentation are."""

from megajax.cli import exit_on_user_error
from megajax.tools.comm_report import main

if __name__ == "__main__":
    exit_on_user_error(main)
