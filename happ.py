

@app.task(base=SingletonTask, bind=True, lock_args=(), name="happ.beat_wait",
          lock_on_contention=Wait(timeout=10))
def beat_wait(self, seconds=1.0, tag=""):
    return body(self, "beatwait", seconds, tag)
