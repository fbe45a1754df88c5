-- wrk script for the `clients` scenario of bench/load.sh: every request names one of
-- 10 000 clients in the x-client header, at random.
math.randomseed(os.time())

request = function()
  return wrk.format(nil, nil, { ["x-client"] = tostring(math.random(1, 10000)) })
end
