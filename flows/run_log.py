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
  leaving the flow's ``Finished in state Failed(...)`` line as the one line that names the error;
- drops the records of a task run that such an error ended (raised inside a task, it reaches the flow, whose final
  line names it): ``Task run failed with exception: X(...)`` and the task's ``Finished in state Failed('Task run
  encountered an exception X: ...')`` (`TASK_FAILED`: the error named by its class);
- strips the traceback from every other record that carries such an error (its level and message stay).

Anything else (a bug, an outage) keeps both records and its traceback. `install` is called when the
``flows`` package is imported, so every flow run (from a worker, a test or ``python -m``) has it.
"""

import logging
import re

from merge_engine.errors import CredentialsMissing, StepmergeError

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
# the starts of Prefect's records of an exception that ended a flow run, each a line besides the final state's
FLOW_EXCEPTION = ("Encountered exception during execution", "Engine execution exited with unexpected exception")
USER_ERRORS = (StepmergeError, CredentialsMissing)
# a task run's records of an exception that ended it: the failure (with the exception), then its final state (by name)
TASK_EXCEPTION = "Task run failed with exception"
TASK_FAILED = re.compile(r"Finished in state Failed\('Task run encountered an exception (\w+):")


def is_user_error(exc: object) -> bool:
    """Whether ``exc`` is an error of the input or the setup that the message alone explains."""
    return isinstance(exc, USER_ERRORS)


def user_error_names() -> set[str]:
    """The class names of every user error (`USER_ERRORS` and subclasses), as a task run's final state names them."""
    names: set[str] = set()
    pending: list[type] = list(USER_ERRORS)
    while pending:
        cls = pending.pop()
        if cls.__name__ not in names:
            names.add(cls.__name__)
            pending.extend(cls.__subclasses__())
    return names


class UserErrorsWithoutTraceback(logging.Filter):
    """Drops the flow's exception record of a user error and strips the traceback of the others that carry one
    (see the module docstring); keeps every other record as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether to keep ``record`` (changed in place: no traceback when it carries a user error)."""
        info, message = record.exc_info, str(record.msg)
        if info and len(info) > 1 and is_user_error(info[1]):
            if record.name == "prefect.flow_runs" and message.startswith(FLOW_EXCEPTION):
                return False
            if record.name == "prefect.task_runs" and record.levelno >= logging.ERROR \
                    and message.startswith(TASK_EXCEPTION):
                return False
            record.exc_info = None
            record.exc_text = None
        elif record.name == "prefect.task_runs" and record.levelno >= logging.ERROR:
            failed = TASK_FAILED.match(message)
            if failed and failed.group(1) in user_error_names():
                return False
        return True


def install() -> None:
    """Add the filter to Prefect's run loggers (once per process)."""
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, UserErrorsWithoutTraceback) for f in logger.filters):
            logger.addFilter(UserErrorsWithoutTraceback())
