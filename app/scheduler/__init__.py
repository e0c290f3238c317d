"""Which pool can run a job (its estimated needs against the pools' sizes), and the
fair-share scheduler's reads: a queued job's place and ETA, the queue summary.

The scheduler's state changes (a job entering its pool's queue, a free worker taking the
next one) are job-store scripts (:mod:`app.jobs.scripts`), atomic with the record.
"""
