#!/usr/bin/env python3
"""bench/scale_restart.py - a kill -9 of one rank in the middle of a training job under
`moe-lua launch --max-restarts 1`, with the timeline of the failure and the recovery.

  python3 bench/scale_restart.py --moe-lua BIN --ranks N --out-dir DIR --kill-after STEP \
      --json FILE -- train key=value ...

The job runs `moe-lua launch -n N --max-restarts 1 train <keys> out_dir=DIR log_every=1`
(the keys should include save_every). This script follows DIR/metrics.jsonl; once a step after
--kill-after is logged it sends SIGKILL to rank 1's process (found by its OMPI_COMM_WORLD_RANK),
then records when each thing happened, in seconds from the launch:

  kill          the SIGKILL was sent
  detected      the launcher reported the rank's death (its "died" or "failed" line)
  restart       the launcher started the job again ("restart 1/1")
  first_step    the restarted job logged its first step (the step after its checkpoint)
  end           the launcher exited

and writes them to --json with the launcher's status, the step the job resumed from, the steps
redone and the losses of every step (the last value logged for a step wins). Exit status: 0 when
the job finished every step after one restart, 1 otherwise.
"""
import argparse, json, os, re, signal, subprocess, sys, threading, time

ap = argparse.ArgumentParser()
ap.add_argument("--moe-lua", required=True)
ap.add_argument("--ranks", type=int, required=True)
ap.add_argument("--out-dir", required=True)
ap.add_argument("--kill-after", type=int, required=True)
ap.add_argument("--kill-rank", type=int, default=1)
ap.add_argument("--json", required=True)
ap.add_argument("--log", default=None)
ap.add_argument("--timeout", type=float, default=540)
ap.add_argument("rest", nargs=argparse.REMAINDER)
a = ap.parse_args()
rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
metrics = os.path.join(a.out_dir, "metrics.jsonl")
cmd = [a.moe_lua, "launch", "-n", str(a.ranks), "--max-restarts", "1"] + rest + \
      [f"out_dir={a.out_dir}", "log_every=1"]
t0 = time.time()
ev = {}
lines = []
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        start_new_session=True)


def reader():
    for line in proc.stdout:
        now = time.time() - t0
        lines.append(f"{now:9.3f} {line.rstrip()}")
        if "moe-lua launch" in line:
            if ("died" in line or "failed" in line or "exited" in line) and "detected" not in ev and "kill" in ev:
                ev["detected"] = now
            if "restart 1/1" in line and "restart" not in ev:
                ev["restart"] = now
        m = re.search(r"resumed from (\S+) at iteration (\d+)", line)
        if m and "restart" in ev:
            ev["resumed_from_step"] = int(m.group(2))


th = threading.Thread(target=reader, daemon=True)
th.start()


def steps_logged():
    out = []
    try:
        with open(metrics) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if "step" in r and "loss" in r:
                    out.append(r)
    except OSError:
        pass
    return out


def rank_pid(rank):
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env and any(b"train" == c for c in cmdline) \
                and os.path.basename(cmdline[0].decode(errors="replace")) == "moe-lua":
            return int(pid)
    return None


n_at_restart = None
while proc.poll() is None and time.time() - t0 < a.timeout:
    recs = steps_logged()
    if "kill" not in ev and any(r["step"] > a.kill_after for r in recs):
        pid = rank_pid(a.kill_rank)
        if pid:
            os.kill(pid, signal.SIGKILL)
            ev["kill"] = time.time() - t0
            ev["killed_at_step"] = max(r["step"] for r in recs)
    if "restart" in ev and n_at_restart is None:
        n_at_restart = len(recs)
    if n_at_restart is not None and "first_step" not in ev and len(recs) > n_at_restart:
        ev["first_step"] = time.time() - t0
    time.sleep(0.05)
if proc.poll() is None:
    os.killpg(proc.pid, signal.SIGKILL)
    ev["timed_out"] = True
rc = proc.wait()
th.join(timeout=5)
ev["end"] = time.time() - t0
losses = {}
for r in steps_logged():
    losses[r["step"]] = r["loss"]
steps = max(losses) if losses else 0
resumed_from = ev.get("resumed_from_step")
out = {"command": cmd, "launcher_status": rc, "events": ev, "resumed_from_step": resumed_from,
       "steps_redone": (ev.get("killed_at_step", 0) - resumed_from) if resumed_from is not None else None,
       "last_step": steps, "losses": [[s, losses[s]] for s in sorted(losses)]}
json.dump(out, open(a.json, "w"), indent=1)
if a.log:
    open(a.log, "w").write("\n".join(lines) + "\n")
order = ["kill", "detected", "restart", "first_step", "end"]
print("restart timeline (s from launch): " + ", ".join(f"{k} {ev[k]:.1f}" for k in order if k in ev) +
      f"; launcher status {rc}; resumed from step {resumed_from}; last step {steps}")
ok = rc == 0 and "kill" in ev and "restart" in ev and "first_step" in ev and resumed_from is not None
sys.exit(0 if ok else 1)
