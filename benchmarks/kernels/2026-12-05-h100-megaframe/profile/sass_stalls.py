import csv,sys,collections
f=sys.argv[1]
rows=list(csv.reader(open(f)))
hdr=rows[1]; data=rows[2:]
ix={h:i for i,h in enumerate(hdr)}
reasons=[h for h in hdr if h.startswith('stall_') and 'Not Issued' not in h]
tot=collections.Counter(); allS=0
for r in data:
    if len(r)<len(hdr): continue
    allS+=int(r[ix['Warp Stall Sampling (All Samples)']] or 0)
    for h in reasons: tot[h]+=int(r[ix[h]] or 0)
print(f, 'instructions',len(data),'samples',allS)
for h,v in tot.most_common(12): print(f'  {h:28s} {v:8d} {100*v/allS:5.1f}%')
# top instructions
top=sorted(data,key=lambda r:-int(r[ix['Warp Stall Sampling (All Samples)']] or 0))[:int(sys.argv[2]) if len(sys.argv)>2 else 30]
pos={id(r):i for i,r in enumerate(data)}
for r in top:
    s=int(r[ix['Warp Stall Sampling (All Samples)']]); 
    rs=sorted(((int(r[ix[h]] or 0),h) for h in reasons),reverse=True)[:3]
    print(f"{pos[id(r)]:6d} {s:7d} {100*s/allS:5.1f}% ex={r[ix['Instructions Executed']]:>8s} {r[1].strip()[:60]:60s} {rs}")
