"""The embedded S3-compatible server (moto's server mode) for the tests and the demo on S3.

Started on a free loopback port like the embedded Kafka broker and stopped by its PID, never by name. moto 5.2.5
keeps objects in memory and honours ``If-None-Match: *`` on PutObject and on
CompleteMultipartUpload (a second put of the same key gets 412), which is what Delta commits on
object storage rely on; ``tests/test_object_storage.py`` checks it with two delta-rs writers.
Credentials are not checked (any key works) unless ``auth=True``, which starts moto with its
IAM checks on and creates a user whose key is the only one accepted.

The server runs through this module (``python -m offsetlake.embedded.local_s3 PORT CLOCK``), which
lets a test set the clock new objects are stamped with (``shift_clock``): S3 has no call that
changes an object's LastModified, and vacuum decides by it which uncommitted files are old.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from offsetlake.embedded.local_broker import free_port, stop_process_group

ACCESS_KEY = "offsetlake-test"
SECRET_KEY = "offsetlake-test-secret"
REGION = "us-east-1"


class LocalS3:
    def __init__(self, log_path: Path, port: int | None = None, auth: bool = False) -> None:
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.auth = auth
        self.process: subprocess.Popen | None = None
        self.access_key, self.secret_key = ACCESS_KEY, SECRET_KEY
        self.clock_file = self.log_path.with_suffix(".clock")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def options(self) -> dict[str, str]:
        """The ``storage:`` settings of a pipeline whose lake is on this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ALLOW_HTTP": "true",
        }

    def start(self, timeout_s: float = 60) -> LocalS3:
        env = dict(os.environ)
        if self.auth:
            # The first requests are let through unauthenticated: create_user, create_access_key,
            # put_user_policy and nothing else; after them every request needs the user's key.
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "offsetlake.embedded.local_s3", str(self.port), str(self.clock_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the S3 server exited with {self.process.returncode}; see {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/data.json", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the S3 server did not answer on {self.endpoint}; see {self.log_path}") from None
                time.sleep(0.2)
        if self.auth:
            self._create_user()
        return self

    def _client(self, service: str):
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )

    def _create_user(self) -> None:
        iam = self._client("iam")
        iam.create_user(UserName="offsetlake")
        key = iam.create_access_key(UserName="offsetlake")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="offsetlake", PolicyName="all", PolicyDocument=json.dumps(policy))
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]

    def bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh name by default) and return its name."""
        name = name or f"lake-{uuid.uuid4().hex[:12]}"
        self._client("s3").create_bucket(Bucket=name)
        return name

    def shift_clock(self, seconds: float) -> None:
        """Stamp objects written from now on ``seconds`` from the real time (negative: in the past)."""
        self.clock_file.write_text(str(float(seconds)))

    def stop(self, timeout_s: float = 30) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        stop_process_group(process, signal.SIGTERM, timeout_s)


def _serve(port: str, clock_file: str) -> None:
    """moto's server on ``port``, stamping new objects with the real time plus the seconds
    ``clock_file`` holds (none: the real time)."""
    from datetime import timedelta

    import moto.s3.models as s3_models
    from moto.core.utils import utcnow
    from moto.server import main

    clock = Path(clock_file)

    def shifted():
        try:
            offset = float(clock.read_text() or 0)
        except (OSError, ValueError):
            offset = 0.0
        return utcnow() + timedelta(seconds=offset)

    s3_models.utcnow = shifted  # FakeKey stamps LastModified with it
    main(["-H", "127.0.0.1", "-p", port])


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2])
