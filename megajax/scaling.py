"""``python -m megajax.scaling``: runs ``megajax.tools.scaling_plan``, the mesh planner on ``megajax.tools.scaling``'s
step-time model, where their code and documentation are."""

from megajax.cli import exit_on_user_error
from megajax.tools.scaling_plan import main

if __name__ == "__main__":
    exit_on_user_error(main)
