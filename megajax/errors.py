"""The errors a user can fix: entry points print their message (which says what to change) without a traceback."""

from megajax.checkpoint import CheckpointError
from megajax.data.loader import LoaderStateError
from megajax.downstream.files import TaskDataError
from megajax.sharding import ConfigError
from megajax.training.health import TrainingDiverged
from megajax.training.workdir_lock import WorkdirInUseError

USER_ERRORS = (ConfigError, CheckpointError, LoaderStateError, TrainingDiverged, WorkdirInUseError, FileNotFoundError,
               TaskDataError)

__all__ = ["USER_ERRORS"]
