"""What a run's log shows when a run fails on input a user can fix: the named error, no traceback.

Prefect logs every exception that ends a flow run ("Encountered exception during execution") and
every task run that fails without retries with its traceback: 25 lines of engine frames around a
message such as ``RunRootNotFound: ... [s3://bucket/exp1]``. For the errors users cause
(`merge_engine.errors.StepmergeError`: bad input, named, with the path at fault) and a missing
credential (`CredentialsMissing`, which names what to set) the message is the whole story, so
`UserErrorsWithoutTraceback` drops the traceback from those records of Prefect's run loggers
(``prefect.flow_runs``, ``prefect.task_runs``); the record, its level and its message stay (the
UI, the API's logs and the worker's console show ``... RunRootNotFound('... [url]')``). Anything
else (a bug, an outage) keeps its traceback. `install` is called when the ``flows`` package is
imported, so every flow run (from a worker, a test or ``python -m``) has it.
"""

import logging

from merge_engine.errors import CredentialsMissing, StepmergeError

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
USER_ERRORS = (StepmergeError, CredentialsMissing)


def is_user_error(exc: object) -> bool:
    """Whether ``exc`` is an error of the input or the setup that the message alone explains."""
    return isinstance(exc, USER_ERRORS)


class UserErrorsWithoutTraceback(logging.Filter):
    """Keeps every record; strips the traceback of those that carry a user error (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        info = record.exc_info
        if info and len(info) > 1 and is_user_error(info[1]):
            record.exc_info = None
            record.exc_text = None
        return True


def install() -> None:
    """Add the filter to Prefect's run loggers (once per process)."""
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, UserErrorsWithoutTraceback) for f in logger.filters):
            logger.addFilter(UserErrorsWithoutTraceback())
