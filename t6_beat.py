"""Beat table. argv: broker. Emulates beat: apply_async(headers={'celery_beat_task': True}) as celery/beat.py:441."""
import sys, time, atexit
sys.path.insert(0, "/tmp/helper31")
from lib import *

broker = sys.argv[1] if len(sys.argv) > 1 else "rabbitmq"
vh = "h31_beat"
port = free_port(63181)
env = env_for(port, broker, vh, ttl=3)
os.environ.update(env)
atexit.register(cleanup)
if broker != "redis":
    rabbit_vhost(vh); atexit.register(rabbit_del, vh)
start_redis(port)
import happ
from celery_redislock import is_skipped
rec = happ.rec()
B = {"celery_beat_task": True}
w1 = start_worker(env, "b1", c=2)
w2 = start_worker(env, "b2", c=2)
fails = []
def check(c, m):
    print(("ok   " if c else "FAIL ") + m)
    if not c: fails.append(m)

# (a) two beats, same entry, task's own policy Wait: beat run must be skipped
r1 = happ.beat_wait.apply_async((2.0, "b1"), headers=B)
assert wait_until(lambda: rec.llen("runs:beatwait") >= 1, 20)
r2 = happ.beat_wait.apply_async((2.0, "b2"), headers=B)
v2 = r2.get(timeout=30); v1 = r1.get(timeout=30)
check(is_skipped(v2) and v1 == "ran:b1", f"two beats (own policy wait): {v1} / {v2}")
# same without beat header: waits and runs
r1 = happ.beat_wait.apply_async((1.0, "n1"))
assert wait_until(lambda: "n1" in rec.lrange("runs:beatwait", 0, -1), 20)
r2 = happ.beat_wait.apply_async((0.2, "n2"))
check(r2.get(timeout=30) == "ran:n2", "non-beat call of the same task waits (control)")

# (c) lock_beat_on_contention="handoff": both run, one after the other
r1 = happ.beat_ho.apply_async((1.5, "h1"), headers=B)
assert wait_until(lambda: rec.llen("runs:beatho") >= 1, 20)
r2 = happ.beat_ho.apply_async((0.5, "h2"), headers=B)
v1, v2 = r1.get(timeout=30), r2.get(timeout=30)
ev = rec.lrange("events:beatho", 0, -1)
check(v1 == "ran:h1" and v2 == "ran:h2" and not overlaps(intervals(ev)), f"beat handoff: {v1} {v2} {ev}")

# (b) a beat run redelivered (acks_late): runs again only after the first ended
if broker != "redis":
    r = happ.beat_job_acks.apply_async((8.0, "R"), headers=B)
    assert wait_until(lambda: rec.get("pid:beatacks:R"), 20)
    pid = int(rec.get("pid:beatacks:R"))
    holder = w1 if pid in children(w1.pid) else w2
    kill_worker(holder); t_kill = time.time()
    rec.set("active:beatacks", 0)
    # message is redelivered at once to the live worker
    ok = wait_until(lambda: rec.llen("runs:beatacks") >= 2, 30)
    ev = rec.lrange("events:beatacks", 0, -1)
    print("   events", ev, "kill at %.3f" % t_kill)
    if ok:
        st2 = float([e for e in ev if e.startswith("start")][1].split(":")[2])
        check(st2 > t_kill, f"redelivered beat run started {st2 - t_kill:.2f}s after the kill (lock TTL 3s)")
    else:
        check(False, "redelivered beat run never ran again")
    try:
        print("   result", r.get(timeout=30), r.state)
    except Exception as e:
        print("   result exc", e)
print("FAILS", fails)
