# One image for every Tangram processor: the runtime installed as a wheel, the apps as folders under /app.
# docker compose runs it once per processor: `tangram run /app/topologies/<app> <processor>`; a one-shot
# `tangram models build /app/topologies/<app> --repository /models` fills the model server's volume.
# tests/integration/test_image.py installs the same wheel into a fresh environment and runs these commands
# from a folder laid out as this file lays out /app (the COPY lines after `WORKDIR /app`).
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY streams ./streams
COPY inference_workers ./inference_workers
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM python:3.11-slim
COPY --from=wheel /dist /dist
# The `intake` extra: the document-intake app's OCR, image and hashing libraries (OpenCV needs libGL and GLib).
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends libgl1 libglib2.0-0 \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --no-cache-dir "$(ls /dist/*.whl)[intake]" && rm -rf /dist
WORKDIR /app
COPY topologies ./topologies
COPY schemas ./schemas
ENV TANGRAM_HOME=/var/lib/tangram
ENTRYPOINT ["tangram"]
