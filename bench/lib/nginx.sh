# nginx as the plain reverse proxy the gateway is measured against (sourced by bench scripts).
#   start_nginx LISTEN_ADDR STORE_ENDPOINT [COMMAND PREFIX...]   # sets NGINX_PID and NGINX_WORKER
#   NGINX_MASTER=off start_nginx ...   # one process that is its own worker (under a tool such as
#                                      # valgrind, which then sees every request)
# One worker, tuned for throughput: uploads streamed (no request buffering, 128 KiB reads),
# responses relayed through 16 x 64 KiB memory buffers and never spooled to disk (unbuffered mode
# would relay in 4 KiB reads), no body limit, keep-alive to the store, Host kept so the client's
# SigV4 signature verifies at the store (nginx cannot verify or re-sign: clients hold the store's
# key). Needs Debian's nginx (`ensure_nginx` installs it when missing and running as root).
ensure_nginx() {  # caller-name
  . scripts/debian-packages.sh
  [ -x /usr/sbin/nginx ] || ensure_debian_packages "/usr/sbin/nginx" "nginx-light" "$1" || true
  [ -x /usr/sbin/nginx ]
}
start_nginx() {
  local addr=$1 endpoint=$2; shift 2
  local dir=$PWD/.tmp/bench-nginx-${addr##*:}
  rm -rf "$dir"; mkdir -p "$dir"
  cat > "$dir/nginx.conf" <<CONF
worker_processes 1;
master_process ${NGINX_MASTER:-on};
daemon off;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $dir/body; proxy_temp_path $dir/proxy; fastcgi_temp_path $dir/fcgi;
  uwsgi_temp_path $dir/uwsgi; scgi_temp_path $dir/scgi;
  upstream store { server ${endpoint#http://}; keepalive 64; }
  server {
    listen $addr;
    client_max_body_size 0;
    location / {
      proxy_pass http://store;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host \$http_host;
      proxy_request_buffering off;
      client_body_buffer_size 128k;
      proxy_buffering on;
      proxy_buffer_size 64k;
      proxy_buffers 16 64k;
      proxy_busy_buffers_size 128k;
      proxy_max_temp_file_size 0;
    }
  }
}
CONF
  "$@" /usr/sbin/nginx -c "$dir/nginx.conf" -e "$dir/error.log" > "$dir/stdout.log" 2>&1 &
  NGINX_PID=$!
  for _ in $(seq 1 50); do [ -s "$dir/nginx.pid" ] && break; sleep 0.1; done
  NGINX_WORKER=
  [ "${NGINX_MASTER:-on}" = off ] && NGINX_WORKER=$NGINX_PID
  for _ in $(seq 1 50); do [ -n "$NGINX_WORKER" ] && break; NGINX_WORKER=$(pgrep -P "$(cat "$dir/nginx.pid")" | head -1) && break; sleep 0.1; done
  [ -n "$NGINX_WORKER" ] || { echo "start_nginx: no nginx worker (see $dir/error.log)" >&2; return 1; }
}
