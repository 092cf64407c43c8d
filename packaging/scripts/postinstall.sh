#!/bin/sh
# postinstall for the .deb (postinst: configure [OLD-VERSION], abort-*) and the .rpm (%post:
# 1 install, 2 upgrade). Registers the user and directories, byte-compiles the venv, and restarts
# the service only if it is running. Never enables or starts it: that is the admin's call, after
# editing /etc/llm-supervisor/config.yaml.
set -e

systemd-sysusers /usr/lib/sysusers.d/llm-supervisor.conf
systemd-tmpfiles --create /usr/lib/tmpfiles.d/llm-supervisor.conf
# The service reads its config as llm-supervisor; the group did not exist when the file was unpacked.
if [ -f /etc/llm-supervisor/config.yaml ]; then
    chgrp llm-supervisor /etc/llm-supervisor/config.yaml
fi
# The package ships no bytecode (it would carry build paths and times); compile it here, so the
# service (which cannot write to /opt) starts fast and root's CLI runs leave no stray files.
/opt/llm-supervisor/venv/bin/python -m compileall -q /opt/llm-supervisor/venv/lib >/dev/null ||
    echo "llm-supervisor: byte-compiling the venv failed; it still runs, only slower to start" >&2

# Only on a booted systemd: chroots, image builds and containers without systemd skip this.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload || true
    # An upgrade restarts a running daemon, and with it every engine (each reloads its model).
    systemctl try-restart llm-supervisor.service || true
fi
exit 0
