"""Usage: python3 rusage_run.py CMD...  Runs CMD, waits, prints one 'rusage:' line to stderr for it and every
descendant it waited for (major page faults: reads from disk through mmap, such as shared libraries; inblock:
512-byte blocks read by the file system; user and system CPU seconds), and exits with CMD's code."""
import resource, subprocess, sys
rc = subprocess.call(sys.argv[1:])
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"rusage: majflt {u.ru_majflt} inblock {u.ru_inblock} ({u.ru_inblock * 512 / 2**20:.0f} MiB) "
      f"user {u.ru_utime:.1f} s sys {u.ru_stime:.1f} s", file=sys.stderr, flush=True)
sys.exit(rc)
