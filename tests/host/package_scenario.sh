#!/bin/bash
# Runs inside the booted Debian container (tests/host/test_packaging.py): install, configure, start,
# upgrade, remove and purge the .deb as an admin would. Every result goes to /out: `KEY=value`
# lines in /out/results, command output in /out/*.txt. No assertions here: the test makes them.
# Inputs: /srv/llmsup-test/pkgs/llm-supervisor_*-1_*.deb and *-2_*.deb, /srv/llmsup-test/fake_vllm.py.
set -u
exec >/out/scenario.log 2>&1
PS4='+ $(date +%T.%N | cut -c1-12) '
set -x
result() { echo "$1=$2" >>/out/results; }
unit_state() { systemctl show llm-supervisor.service -p "$1" --value; }

# Every engine and daemon process, by user and by the fake's script name.
leftovers() { { pgrep -u llm-supervisor; pgrep -f fake_vllm.py; } 2>/dev/null | sort -u | tr '\n' ' '; }

# Wait until the unit's current daemon reports both engines READY in its status file.
wait_ready() {
    for _ in $(seq 200); do
        if python3 - "$(unit_state MainPID)" <<'EOF'
import json, sys
try:
    status = json.load(open("/var/lib/llm-supervisor/status.json"))
except (OSError, ValueError):
    sys.exit(1)
engines = status["engines"]
ready = all(engines.get(n, {}).get("state") == "ready" for n in ("fake0", "fake1"))
sys.exit(0 if ready and str(status["pid"]) == sys.argv[1] else 1)
EOF
        then return 0; fi
        sleep 0.1
    done
    return 1
}

result python "$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
old=$(ls /srv/llmsup-test/pkgs/llm-supervisor_*-1_*.deb)
new=$(ls /srv/llmsup-test/pkgs/llm-supervisor_*-2_*.deb)

# ---- install: user, directories, config, and nothing enabled or started ------------------------
dpkg -i "$old" </dev/null >/out/install.txt 2>&1
result install_rc $?
result user "$(id llm-supervisor)"
result config_stat "$(stat -c '%a %U:%G' /etc/llm-supervisor/config.yaml)"
result state_dir_stat "$(stat -c '%a %U:%G' /var/lib/llm-supervisor)"
result models_dir_stat "$(stat -c '%a %U:%G' /var/lib/llm-supervisor/models)"
result enabled_after_install "$(systemctl is-enabled llm-supervisor.service)"
result active_after_install "$(systemctl is-active llm-supervisor.service)"
result version_output "$(llm-supervisor --version)"
result venv_python "$(readlink -f /opt/llm-supervisor/venv/bin/python)"
result pycache_count "$(find /opt/llm-supervisor/venv -name '*.pyc' | wc -l)"

# The shipped example names models and engines that do not exist here: doctor says so.
llm-supervisor doctor >/out/doctor-example.txt 2>&1
result doctor_example_rc $?

# ---- configure: two fake engines, written over the conffile as an admin would -------------------
cat >/etc/llm-supervisor/config.yaml <<'EOF'
# edited by the admin
supervisor:
  tick_interval_s: 0.5
engines:
  - name: fake0
    model: tiny
    port: 8000
    command: [/usr/bin/python3, /srv/llmsup-test/fake_vllm.py]
    start_timeout_s: 60
    stop_timeout_s: 5
    drain_grace_s: 0
  - name: fake1
    model: tiny
    port: 8001
    command: [/usr/bin/python3, /srv/llmsup-test/fake_vllm.py]
    start_timeout_s: 60
    stop_timeout_s: 5
    drain_grace_s: 0
EOF
config_sum=$(sha256sum /etc/llm-supervisor/config.yaml)
llm-supervisor doctor >/out/doctor.txt 2>&1
result doctor_rc $?

# ---- start: Type=notify, so start returns once the daemon sent READY=1 ---------------------------
systemctl start llm-supervisor.service
result start_rc $?
wait_ready
result ready_rc $?
result active "$(systemctl is-active llm-supervisor.service)"
result status_text "$(unit_state StatusText)"
first_pid=$(unit_state MainPID)
result main_user "$(ps -o user= -p "$first_pid")"
llm-supervisor status --json >/out/status.json 2>/out/status-err.txt
result status_rc $?
llm-supervisor status >/out/status.txt 2>&1
# journald writes synchronously; give forwarded engine lines a moment to be stored anyway.
sleep 1
journalctl -u llm-supervisor.service -o json --no-pager >/out/journal.json
journalctl -u llm-supervisor.service ENGINE=fake0 -o json --no-pager >/out/journal-fake0.json
journalctl -u llm-supervisor.service ENGINE=fake0 --no-pager >/out/journal-fake0.txt
systemctl enable llm-supervisor.service
result enable_rc $?

# ---- upgrade to the rebuilt package: the edited config stays, the running daemon restarts ---------
dpkg -i "$new" </dev/null >/out/upgrade.txt 2>&1
result upgrade_rc $?
result upgraded_version "$(dpkg-query -W -f '${Version}' llm-supervisor)"
[ "$(sha256sum /etc/llm-supervisor/config.yaml)" = "$config_sum" ]
result config_kept $?
result config_stat_after_upgrade "$(stat -c '%a %U:%G' /etc/llm-supervisor/config.yaml)"
result dpkg_dist_files "$(ls /etc/llm-supervisor/ | tr '\n' ' ')"
wait_ready
result ready_after_upgrade_rc $?
result active_after_upgrade "$(systemctl is-active llm-supervisor.service)"
second_pid=$(unit_state MainPID)
[ "$first_pid" != "$second_pid" ]
result restarted_on_upgrade $?

# ---- remove: service stopped and disabled, no process left, files gone, config kept ---------------
dpkg -r llm-supervisor </dev/null >/out/remove.txt 2>&1
result remove_rc $?
result leftovers_after_remove "$(leftovers)"
result active_after_remove "$(systemctl is-active llm-supervisor.service)"
result load_state_after_remove "$(unit_state LoadState)"
result wants_link_after_remove "$(ls /etc/systemd/system/multi-user.target.wants/ | grep -c llm-supervisor)"
result opt_after_remove "$(ls -A /opt/llm-supervisor 2>&1 | head -3 | tr '\n' ' ')"
result wrapper_after_remove "$(ls /usr/bin/llm-supervisor 2>&1)"
result config_after_remove "$(ls /etc/llm-supervisor 2>&1 | tr '\n' ' ')"

# ---- purge: the config goes too ----------------------------------------------------------------
dpkg -P llm-supervisor </dev/null >/out/purge.txt 2>&1
result purge_rc $?
result dpkg_status_after_purge "$(dpkg-query -W -f '${Status}' llm-supervisor 2>&1)"
result etc_after_purge "$(ls -A /etc/llm-supervisor 2>&1)"
result unit_files_after_purge "$(systemctl list-unit-files 'llm-supervisor*' --no-legend | wc -l)"
result leftovers_after_purge "$(leftovers)"
result done 1
