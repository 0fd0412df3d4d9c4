from ecoserve.sched.interface import Executor, ScheduledChunk, SchedulerOutput, StepResult
from ecoserve.sched.policies import POLICIES
from ecoserve.sched.scheduler import Scheduler
from ecoserve.sched.status import RequestProgress, SchedulerStatus

__all__ = ["Executor", "POLICIES", "RequestProgress", "ScheduledChunk", "Scheduler", "SchedulerOutput",
           "SchedulerStatus", "StepResult"]
