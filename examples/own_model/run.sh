#!/usr/bin/env bash
# The whole example on one machine: data, model, fleet, coordinator (embedded broker, mutual TLS, strategy
# fedsdk with packed Paillier at 2048 bits), five devices that fit and one that does not, the exported
# models scored with plain onnxruntime. Run it from anywhere; it works in ./run/ beside this script.
#   bash run.sh [ROUNDS]          (needs fedsdk[coordinator] and torch for model.py)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
rounds="${1:-8}"
mkdir -p "$here/run" && cd "$here/run"
rm -rf data fleet state models logs sensor.onnx
mkdir -p models logs

python "$here/make_data.py" --out data
python "$here/model.py" --out sensor.onnx
fedsdk provision --fleet "$here/fleet.json" --out fleet > logs/provision.txt

fedsdk coordinator --model sensor.onnx --strategy fedsdk --rounds "$rounds" \
    --min-clients 5 --start-clients 5 --deadline 120 --epochs 2 --exit-when-done --state-dir state \
    --listen 127.0.0.1:8883 --federation sensors --he fleet/coordinator/he \
    --ca fleet/coordinator/ca.pem --cert fleet/coordinator/client.pem --key fleet/coordinator/client.key \
    --broker-cert fleet/broker/server.pem --broker-key fleet/broker/server.key \
    --broker-crl fleet/broker/crl.pem &
coordinator=$!
sleep 3

devices=()
for k in 01 02 03 04 05; do
    fedsdk join --kit "fleet/devices/pi-$k" --data "data/pi-$k.csv" --eval-split 0.2 \
        --save-model "models/pi-$k.onnx" > "logs/pi-$k.txt" 2>&1 &
    devices+=($!)
done
# pi-06 lost a sensor (11 features): refused when it joins, while the others go on
fedsdk join --kit fleet/devices/pi-06 --data data/pi-06.csv || echo "pi-06 exited $? (refused, as expected)"

for pid in "${devices[@]}"; do wait "$pid"; done
wait "$coordinator"
tail -n 1 logs/pi-0[1-5].txt
for k in 01 02 03 04 05; do python "$here/score.py" "models/pi-$k.onnx" data/test.csv; done
