"""Every 15 s: per process of the spruce servers (and their children), each thread's name and CPU ticks."""
import os, sys, time
out = open(sys.argv[1], "w")
for snap in range(int(sys.argv[2])):
    time.sleep(15)
    procs = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        procs[int(pid)] = (ppid, cmd)
    servers = {pid for pid, (pp, cmd) in procs.items() if "spruce" in cmd and " serve " in cmd}
    for pid, (ppid, cmd) in sorted(procs.items()):
        if pid not in servers and ppid not in servers:
            continue
        server = pid if pid in servers else ppid
        label = procs[server][1].split("--speculative-adaptive")[0][-60:] + ("|adaptive" if "adaptive" in procs[server][1] else "|plain")
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
                f = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            print(snap, server, pid, "server" if pid == server else "child", tid, comm, f[11], f[12], f[36] if len(f) > 36 else -1, label, file=out)
    out.flush()
