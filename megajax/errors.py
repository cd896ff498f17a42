"""The errors a user can fix. Each message says what is wrong and what to change; entry points print it as one
``error: ...`` line (exit 1) instead of a traceback. Every such error derives from ``UserError``, so this module
imports nothing and every layer can raise them."""


class UserError(Exception):
    """A mistake the user can fix (a config field, a path, a workdir); the message says how."""


class ConfigError(UserError, ValueError):
    """A config that cannot run; the message names the field to change."""


class ShardingConfigError(ConfigError):
    """A sharding rule or mesh that cannot work; the message says what to change."""


# FileNotFoundError: a missing config, checkpoint or data file, raised by the standard library as often as by us.
USER_ERRORS = (UserError, FileNotFoundError)
