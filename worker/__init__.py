"""worker: the Celery side. One reliability configuration, thin tasks, and the job runner
that claims a job, fetches its inputs into a content-addressed cache, runs it with the
merge library and publishes its files, the manifest last.
"""
