"""Every 3 s: per spruce server process and its children, /proc counters (CPU, faults, context switches, RSS,
mappings, threads) as JSON lines; the server is named by its log file (its stdout)."""
import json, os, sys, time
out = open(sys.argv[1], "w")
end = time.time() + float(sys.argv[2])
while time.time() < end:
    t = time.time()
    procs = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        procs[int(pid)] = (int(stat[1]), cmd, stat)
    servers = {pid for pid, (pp, cmd, _) in procs.items() if "spruce" in cmd and " serve " in cmd}
    for pid, (ppid, cmd, stat) in procs.items():
        if pid not in servers and ppid not in servers:
            continue
        server = pid if pid in servers else ppid
        try:
            log = os.readlink(f"/proc/{server}/fd/1")
            status = dict(l.split(":", 1) for l in open(f"/proc/{pid}/status") if ":" in l)
            maps = sum(1 for _ in open(f"/proc/{pid}/maps"))
        except OSError:
            continue
        rec = {"t": t, "server": os.path.basename(log), "pid": pid, "role": "http" if pid == server else "engine",
               "minflt": int(stat[7]), "majflt": int(stat[9]), "utime": int(stat[11]), "stime": int(stat[12]),
               "threads": int(stat[17]), "vcsw": int(status["voluntary_ctxt_switches"]),
               "nvcsw": int(status["nonvoluntary_ctxt_switches"]), "rss_kb": int(status["VmRSS"].split()[0]),
               "cpus": status["Cpus_allowed_list"].strip(), "maps": maps}
        out.write(json.dumps(rec) + "\n")
    out.flush()
    time.sleep(max(0.0, 3.0 - (time.time() - t)))
