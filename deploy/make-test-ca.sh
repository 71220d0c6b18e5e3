#!/usr/bin/env bash
# Make a private certificate authority and the broker's TLS certificate (and optional client certificates).
#
#   deploy/make-test-ca.sh [-d DIR] [-s SAN]... [-o OWNER] [-b BROKER_OWNER] [-D DAYS] [CLIENT...]
#
#   -d DIR           output directory (default: deploy/secrets/tls next to this script)
#   -s SAN           another name of the broker, e.g. -s DNS:mosquitto -s DNS:broker.example.net -s IP:10.0.0.5
#                    (localhost and 127.0.0.1 are always included)
#   -o OWNER         chown the client keys to OWNER (user[:group]; needs root)
#   -b BROKER_OWNER  chown the server key to BROKER_OWNER (1883:1883 in eclipse-mosquitto; needs root)
#   -D DAYS          validity of new certificates (default 365)
#   CLIENT...        names of client certificates to issue (CN=name; for require_certificate true)
#
# Writes DIR/ca.crt, DIR/ca.key, DIR/server.crt, DIR/server.key and DIR/<client>.crt, DIR/<client>.key; keys are
# mode 0600. An existing DIR/ca.key is reused, so adding clients later keeps earlier certificates valid. Keys are
# ECDSA P-256. This is a small private CA for tests and closed fleets, not a replacement for a managed PKI:
# keep ca.key offline once the certificates are issued.
set -euo pipefail

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0" >&2; exit 2; }
die() { echo "make-test-ca.sh: $*" >&2; exit 2; }

out_dir="$(cd "$(dirname "$0")" && pwd)/secrets/tls"
sans=("DNS:localhost" "IP:127.0.0.1")
owner="" broker_owner="" days=365
while getopts "d:s:o:b:D:h" opt; do
    case "$opt" in
        d) out_dir="$OPTARG" ;;
        s) [[ "$OPTARG" =~ ^(DNS|IP):[A-Za-z0-9.:-]+$ ]] || die "-s needs DNS:name or IP:address, got '$OPTARG'"
           sans+=("$OPTARG") ;;
        o) owner="$OPTARG" ;;
        b) broker_owner="$OPTARG" ;;
        D) [[ "$OPTARG" =~ ^[1-9][0-9]{0,4}$ ]] || die "-D needs a number of days, got '$OPTARG'"
           days="$OPTARG" ;;
        *) usage ;;
    esac
done
shift $((OPTIND - 1))
for client in "$@"; do
    [[ "$client" =~ ^[A-Za-z0-9_.-]{1,64}$ ]] || die "client name '$client' must be 1-64 letters, digits, '_', '.' or '-'"
    [[ "$client" != "ca" && "$client" != "server" ]] || die "client name '$client' would overwrite the $client files"
done
command -v openssl >/dev/null || die "openssl not found"

umask 077
mkdir -p "$out_dir"
cd "$out_dir"

new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# issue NAME EXTENSIONS: a key and a certificate for CN=NAME signed by the CA.
issue() {
    local name="$1" extensions="$2" ext_file
    new_key "$name.key"
    ext_file="$(mktemp)"
    printf '%s\n' "$extensions" > "$ext_file"
    openssl req -new -key "$name.key" -subj "/CN=$name" -out "$name.csr"
    openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" -sha256 \
        -extfile "$ext_file" -out "$name.crt" 2>/dev/null
    rm -f "$name.csr" "$ext_file"
    chmod 644 "$name.crt"
}

if [[ ! -f ca.key ]]; then
    new_key ca.key
    openssl req -x509 -new -key ca.key -sha256 -days "$days" -subj "/CN=fedge private CA" \
        -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" -out ca.crt
    chmod 644 ca.crt
fi

san_list="$(IFS=,; echo "${sans[*]}")"
issue server "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=$san_list"
for client in "$@"; do
    issue "$client" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth"
done

if [[ -n "$broker_owner" ]]; then chown "$broker_owner" server.key; fi
# certificates are public, keys stay 600: the broker and the services must be able to enter the directory
chmod 755 .
if [[ -n "$owner" && $# -gt 0 ]]; then
    for client in "$@"; do chown "$owner" "$client.key"; done
fi
echo "wrote CA, server certificate ($san_list)${*:+ and client certificates for $*} in $out_dir"
