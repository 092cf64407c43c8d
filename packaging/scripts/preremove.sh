#!/bin/sh
# preremove for the .deb (prerm: remove, upgrade NEW-VERSION, deconfigure, failed-upgrade) and the
# .rpm (%preun: 0 erase, 1 upgrade). On removal: stop and disable the service. On every deb run
# and on rpm erase: delete the bytecode postinstall compiled, which the package does not list.
set -e

case "$1" in
    remove | 0)
        if [ -d /run/systemd/system ]; then
            systemctl stop llm-supervisor.service || true
        fi
        systemctl --no-reload disable llm-supervisor.service >/dev/null 2>&1 || true
        ;;
esac
case "$1" in
    remove | upgrade | deconfigure | failed-upgrade | 0)
        # rpm upgrades run the old %preun (1) after the new %post: that bytecode is the new one's.
        find /opt/llm-supervisor/venv -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null || true
        ;;
esac
exit 0
