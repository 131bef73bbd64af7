"""What a run's log shows when a run fails on input a user can fix: one line naming the error, no traceback.

Prefect logs an exception that ends a flow run two or three times: ``Encountered exception during execution:
X(...)`` with its traceback, then ``Finished in state Failed('Flow run encountered an exception: X: ...')``, and
where the engine raises it on (a worker's run, a flow called without ``return_state``) ``Engine execution
exited with unexpected exception`` with the traceback again. A
task run that fails without retries is logged with its traceback too. For the errors users cause
(`merge_engine.errors.StepmergeError`: bad input, named, with the path at fault) and a missing
credential (`CredentialsMissing`, which names what to set) the message is the whole story, so
`UserErrorsWithoutTraceback`, on Prefect's run loggers (``prefect.flow_runs``, ``prefect.task_runs``):

- drops the flow's ``Encountered exception ...`` and ``Engine execution exited ...`` records (`FLOW_EXCEPTION`),
  leaving the ``Finished in state Failed(...)`` line as the one line that names the error;
- strips the traceback from every other record that carries such an error (its level and message stay).

Anything else (a bug, an outage) keeps both records and its traceback. `install` is called when the
``flows`` package is imported, so every flow run (from a worker, a test or ``python -m``) has it.
"""

import logging

from merge_engine.errors import CredentialsMissing, StepmergeError

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
# the starts of Prefect's records of an exception that ended a flow run, each a line besides the final state's
FLOW_EXCEPTION = ("Encountered exception during execution", "Engine execution exited with unexpected exception")
USER_ERRORS = (StepmergeError, CredentialsMissing)


def is_user_error(exc: object) -> bool:
    """Whether ``exc`` is an error of the input or the setup that the message alone explains."""
    return isinstance(exc, USER_ERRORS)


class UserErrorsWithoutTraceback(logging.Filter):
    """Drops the flow's exception record of a user error and strips the traceback of the others that carry one
    (see the module docstring); keeps every other record as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether to keep ``record`` (changed in place: no traceback when it carries a user error)."""
        info = record.exc_info
        if info and len(info) > 1 and is_user_error(info[1]):
            if record.name == "prefect.flow_runs" and str(record.msg).startswith(FLOW_EXCEPTION):
                return False
            record.exc_info = None
            record.exc_text = None
        return True


def install() -> None:
    """Add the filter to Prefect's run loggers (once per process)."""
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, UserErrorsWithoutTraceback) for f in logger.filters):
            logger.addFilter(UserErrorsWithoutTraceback())
