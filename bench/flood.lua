-- wrk script for the `flood` scenario of bench/load.sh: every request names a client never
-- seen before in the x-client header (a client rotating API keys or IPv6 addresses).
-- Each wrk thread numbers its own requests under its own prefix.
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("id", threads)
end

local prefix, counter

function init(args)
  math.randomseed(os.time())
  -- A run-unique part as well: a server that outlived an earlier run must not see repeats.
  prefix = string.format("%d-%d-", id or 0, math.random(1, 1000000000))
  counter = 0
end

request = function()
  counter = counter + 1
  return wrk.format(nil, nil, { ["x-client"] = prefix .. counter })
end
