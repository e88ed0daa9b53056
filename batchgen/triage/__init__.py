"""What to do with a logged divergence: replay its op from the record alone, shrink its workload
to a minimal one (``minimize``), and write that as a pytest regression test."""
