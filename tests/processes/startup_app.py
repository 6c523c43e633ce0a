"""The app of the worker start tests: its settings come from the environment.

REDISLOCK_TEST_URL is the base redis:// URL of the test's server (broker and
results); REDISLOCK_TEST_LOCK_URL the lock store; REDISLOCK_TEST_CONF a JSON
object of extra settings (the bad ones under test); REDISLOCK_TEST_TASK_OPTIONS
a JSON object of options for the task's ``@app.task(...)`` (class made when
the worker finalizes the app) and REDISLOCK_TEST_BASE_OPTIONS one of
attributes of a task base class defined here (class made when the module is
imported, as Celery's command line loads the app). The broker as
``tests/brokers.py`` says (REDISLOCK_TEST_BROKER, REDISLOCK_TEST_VHOST).
"""

from __future__ import annotations

import json
import os

from celery import Celery

from celery_redislock import SingletonTask
from tests.brokers import subprocess_broker_conf

BASE_URL = os.environ.get("REDISLOCK_TEST_URL", "redis://127.0.0.1:1")

app = Celery("redislock_startup")
app.conf.update(
    **subprocess_broker_conf(f"{BASE_URL}/0"),
    result_backend=f"{BASE_URL}/1",
    redislock_url=os.environ.get("REDISLOCK_TEST_LOCK_URL", f"{BASE_URL}/2"),
    task_default_queue="tests",
    broker_connection_retry_on_startup=True,
)
app.conf.update(json.loads(os.environ.get("REDISLOCK_TEST_CONF", "{}")))


Base = type(
    "Base", (SingletonTask,), json.loads(os.environ.get("REDISLOCK_TEST_BASE_OPTIONS", "{}"))
)


@app.task(base=Base, **json.loads(os.environ.get("REDISLOCK_TEST_TASK_OPTIONS", "{}")))
def job() -> str:
    return "ran"
