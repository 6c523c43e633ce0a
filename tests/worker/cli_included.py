"""A task module that an app of ``test_cli.py`` lists in ``include``.

Only a worker (or the CLI) imports it, as Celery's ``include`` and Django's
``autodiscover_tasks`` modules are: the test drops it from ``sys.modules``
first. Its task joins the app the test made last (``test_cli.INCLUDING``).
"""

from __future__ import annotations

from celery_redislock import SingletonTask
from tests.worker.test_cli import INCLUDING

app = INCLUDING[-1]


@app.task(base=SingletonTask, shared=False, name="proj.included", lock_ttl=3)
def included(n: int) -> None:
    pass
