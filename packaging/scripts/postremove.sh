#!/bin/sh
# postremove for the .deb (postrm: remove, purge, upgrade, ...) and the .rpm (%postun: 0 erase,
# 1 upgrade). systemd forgets the removed unit. Kept on purge, on purpose: /var/lib/llm-supervisor
# (state and models an admin copied in), /var/cache/llm-supervisor and the llm-supervisor user
# (Debian never deletes system users: files it owned would pass to the next user given its uid).
set -e

case "$1" in
    remove | purge | 0)
        if [ -d /run/systemd/system ]; then
            systemctl daemon-reload || true
        fi
        ;;
esac
exit 0
