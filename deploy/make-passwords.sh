#!/usr/bin/env bash
# Generate the secrets of a fedge fleet: an MQTT password per node and for the coordinator, a signing key
# per node, and the coordinator's instruction key pair.
#
#   deploy/make-passwords.sh [-d DIR] [-r | -i] [-o OWNER] [-b BROKER_OWNER] (-n COUNT | NODE_ID...)
#
#   -d DIR           output directory (default: deploy/secrets next to this script)
#   -r               rotate: new secrets for everyone (by default existing ones are kept)
#   -i               rotate only the coordinator's instruction key: its public key is kept as previous.pub
#                    for agents to trust until the coordinator signs with the new one (docs/deployment.md)
#   -o OWNER         chown the credential files to OWNER (user[:group]) so the fedge service can read them
#                    (10001:10001 is the fedge user in deploy/Dockerfile; needs root)
#   -b BROKER_OWNER  chown the broker's password file (1883:1883 is mosquitto in eclipse-mosquitto; needs root)
#   -n COUNT         nodes node-1 ... node-COUNT
#   NODE_ID...       explicit node ids: 1-64 letters, digits, '_', '.' or '-' (no ':', which ends the
#                    user name in Mosquitto's password file)
#
# Writes, all mode 0600, in 0700 directories:
#   DIR/mosquitto/passwd               hashed (PBKDF2-SHA512) for Mosquitto's password_file
#   DIR/credentials/<user>.password    the plain password of one client, for [mqtt] password_file
#   DIR/node-keys/<node>.key           the node's HMAC key: the agent's signing_key_file, and the coordinator's
#                                      node_keys_dir holds them all (replies must then be signed)
#   DIR/instruction-keys/coordinator.key  the coordinator's Ed25519 private key (PEM): its instruction_key_file
#   DIR/instruction-keys/coordinator.pub  its public key, for every agent's instruction_key_files (agents then
#                                      run only instructions the coordinator signed); not secret, but keep it
#                                      from being replaced
#   DIR/instruction-keys/previous.pub  after -i: the public key being replaced
# The MQTT username of a node is its node id (the broker ACL isolates nodes by username); the coordinator's
# is "coordinator". Re-running keeps the secrets of users it names (so adding a node changes nothing for the
# others), makes them for new ones, and deletes those of nodes it no longer names: the password file and
# node-keys/ then hold exactly the users of that run. No secret appears on a command line.
set -euo pipefail

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0" >&2; exit 2; }
die() { echo "make-passwords.sh: $*" >&2; exit 2; }

out_dir="$(cd "$(dirname "$0")" && pwd)/secrets"
owner="" broker_owner="" count="" rotate="" rotate_instruction_key=""
while getopts "d:rio:b:n:h" opt; do
    case "$opt" in
        d) out_dir="$OPTARG" ;;
        r) rotate=1 ;;
        i) rotate_instruction_key=1 ;;
        o) owner="$OPTARG" ;;
        b) broker_owner="$OPTARG" ;;
        n) count="$OPTARG" ;;
        *) usage ;;
    esac
done
shift $((OPTIND - 1))

nodes=("$@")
if [[ -n "$count" ]]; then
    [[ ${#nodes[@]} -eq 0 ]] || die "give -n COUNT or node ids, not both"
    [[ "$count" =~ ^[1-9][0-9]{0,4}$ ]] || die "-n needs a count from 1 to 99999, got '$count'"
    for ((i = 1; i <= count; i++)); do nodes+=("node-$i"); done
fi
[[ ${#nodes[@]} -gt 0 ]] || usage
[[ -z "$rotate" || -z "$rotate_instruction_key" ]] || die "give -r (everything) or -i (the instruction key), not both"
command -v mosquitto_passwd >/dev/null || die "mosquitto_passwd not found (apt-get install mosquitto)"
command -v openssl >/dev/null || die "openssl not found (apt-get install openssl)"

declare -A seen=()
for node in "${nodes[@]}"; do
    # fedge.transport.topics.validate_name's rule (safe as a topic level and as %u in ACL patterns) minus
    # ':', which Mosquitto's password file uses as the user name/hash separator.
    [[ "$node" =~ ^[A-Za-z0-9_.-]{1,64}$ ]] || die "node id '$node' must be 1-64 letters, digits, '_', '.' or '-'"
    [[ "$node" != "coordinator" ]] || die "node id 'coordinator' is reserved for the coordinator"
    [[ -z "${seen[$node]:-}" ]] || die "node id '$node' given twice"
    seen[$node]=1
done

random_password() {
    # 32 random bytes as URL-safe base64 without padding (43 characters, 256 bits).
    head -c 32 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n'
}

random_key() {
    # 32 random bytes as 64 hex digits; fedge uses the line's bytes as the HMAC-SHA256 key.
    od -An -tx1 -N32 /dev/urandom | tr -d ' \n'
}

umask 077
keys="$out_dir/instruction-keys"
mkdir -p "$out_dir/mosquitto" "$out_dir/credentials" "$out_dir/node-keys" "$keys"
chmod 700 "$out_dir" "$out_dir/mosquitto" "$out_dir/credentials" "$out_dir/node-keys" "$keys"
# Secrets of nodes left out of this run must not linger (the coordinator trusts every key in node-keys/).
for file in "$out_dir"/credentials/*.password "$out_dir"/node-keys/*.key; do
    [[ -e "$file" ]] || continue
    user="$(basename "${file%.*}")"
    if [[ -n "$rotate" || ( "$user" != "coordinator" && -z "${seen[$user]:-}" ) ]]; then rm -f "$file"; fi
done

# keep_or_make FILE GENERATOR: print the secret in FILE, first writing a new one if there is none.
keep_or_make() {
    [[ -s "$1" ]] || printf '%s\n' "$("$2")" > "$1"
    head -n 1 "$1"
}

plain="$(mktemp "$out_dir/mosquitto/.passwd.XXXXXX")"
trap 'rm -f "$plain"' EXIT
for user in coordinator "${nodes[@]}"; do
    password="$(keep_or_make "$out_dir/credentials/$user.password" random_password)"
    printf '%s:%s\n' "$user" "$password" >> "$plain"
done
for node in "${nodes[@]}"; do
    keep_or_make "$out_dir/node-keys/$node.key" random_key > /dev/null
done

# The coordinator's instruction key: Ed25519, so agents hold only the public half and a compromised device
# cannot sign instructions for the others. -r starts afresh; -i keeps the old public key for the changeover.
if [[ -n "$rotate" ]]; then
    rm -f "$keys/coordinator.key" "$keys/coordinator.pub" "$keys/previous.pub"
elif [[ -n "$rotate_instruction_key" && -s "$keys/coordinator.pub" ]]; then
    mv -f "$keys/coordinator.pub" "$keys/previous.pub"
    rm -f "$keys/coordinator.key"
fi
if [[ ! -s "$keys/coordinator.key" || ! -s "$keys/coordinator.pub" ]]; then
    openssl genpkey -algorithm ed25519 -out "$keys/.coordinator.key.new" 2>/dev/null \
        || die "openssl cannot make an Ed25519 key (OpenSSL 1.1.1 or later is needed)"
    openssl pkey -in "$keys/.coordinator.key.new" -pubout -out "$keys/.coordinator.pub.new" 2>/dev/null
    mv -f "$keys/.coordinator.pub.new" "$keys/coordinator.pub"
    mv -f "$keys/.coordinator.key.new" "$keys/coordinator.key"
fi
# -U hashes a plain "user:password" file in place, so passwords never reach a command line.
mosquitto_passwd -U "$plain"
mv -f "$plain" "$out_dir/mosquitto/passwd"
trap - EXIT

if [[ -n "$owner" ]]; then
    chown "$owner" "$out_dir/credentials" "$out_dir"/credentials/*.password "$out_dir/node-keys" \
        "$out_dir"/node-keys/*.key "$keys" "$keys"/*
fi
if [[ -n "$broker_owner" ]]; then
    chown "$broker_owner" "$out_dir/mosquitto" "$out_dir/mosquitto/passwd"
fi
if [[ -n "$owner$broker_owner" ]]; then
    # the other owners must pass through this directory to reach their own (each stays 700): on a host,
    # Mosquitto opens $out_dir/mosquitto/passwd itself, after dropping root
    chmod 711 "$out_dir"
fi
echo "wrote $out_dir/mosquitto/passwd, credentials and node keys for coordinator, ${nodes[*]}, instruction keys"
